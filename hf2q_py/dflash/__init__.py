"""DFlash block drafting: the drafter model, its training data and its training loop."""
