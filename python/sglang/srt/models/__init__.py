"""Model definitions with HF config fields and HF weight names."""
