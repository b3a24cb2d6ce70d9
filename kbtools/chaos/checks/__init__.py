"""The checks of a chaos run's invariants, once the system has settled, and the run's table."""
