"""Reports: figures as dicts for JSON, and rich tables for people."""
