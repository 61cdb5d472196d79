"""Documentation assets, not measurements: the README's dashboard picture."""
