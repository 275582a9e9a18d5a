"""Opt-in plugins that run inside a trainer and push what they see to tqmon's event API.

Nothing here is imported by tqmon itself: the trainer loads these modules by configuration.
"""
