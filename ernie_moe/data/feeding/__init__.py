"""Rows into each rank's micro-batches: the length index and the plan of rows, background workers, the
feeds the trainer takes and their saved positions, and the data report."""
