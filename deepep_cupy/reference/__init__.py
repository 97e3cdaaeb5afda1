"""The NumPy references every GPU result is checked against (pure NumPy)."""
