"""The sources: each watches one thing the trainer leaves behind and reports it to the tracker (see ``polling``)."""
