"""What the product ships that is learned from runs: the trained tiny model and its MagCache ratios."""
