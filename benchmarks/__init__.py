"""Speed and quality runs (JSON + Markdown + plots)."""
