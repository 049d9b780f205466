"""`serve` under load: throughput and latency, and the load acceptance (every video checked)."""
