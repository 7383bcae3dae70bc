"""Model fetching and the shipped drafter checkpoints."""
