"""Reading verl's checkpoint dir safely, and predicting the resume from it."""
