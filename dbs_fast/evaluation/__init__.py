"""Evaluation: the keyword-to-phrase and CommonGen runs, the judge model, text metrics."""
