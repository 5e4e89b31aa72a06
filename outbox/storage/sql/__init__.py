"""Statement builders: pure functions returning SQLAlchemy Core statements, one module per owner."""
