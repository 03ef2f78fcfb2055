"""Example models and scripts for pipedream-ft."""
