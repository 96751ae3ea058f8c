"""What a run reports: the metrics logger (JSONL, TensorBoard), the surge detector, reports and plots."""
