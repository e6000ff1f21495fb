"""The leaderboard's parts behind ``evaluate.py``: runs (one row each), tables, plots, validation, tracking."""
