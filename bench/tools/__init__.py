"""Documentation assets, not measurements: the results chart and the README's dashboard picture."""
