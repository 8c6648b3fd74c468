"""Built-in mm3 backends, each registered through the ``mm3.backends`` entry-point group."""
