"""Operating the database rather than serving agents.

The embedded server, scratch databases, login roles, retention (``outbox gc``)
and its archive. The CLI and the tests call these; the client and the daemons
never do (except that connecting with no DSN starts the embedded server).
"""
