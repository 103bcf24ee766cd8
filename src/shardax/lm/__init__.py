"""The main job: a transformer language model trained on text, as one client of the Trainer."""
