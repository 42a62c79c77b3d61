"""The patterns behind readable errors, one module per family of failures."""
