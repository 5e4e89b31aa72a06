"""Storage: the only package that builds or executes SQL and imports the database driver."""
