"""Demo model generators (the only code outside models that writes torch weights)."""
