"""Layer split: contiguous layer ranges (stages) placed on devices."""
