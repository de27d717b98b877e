"""Small helpers every package shares: atomic file writes and a JSON-over-HTTP client."""
