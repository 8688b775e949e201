"""The ``advisory`` strategy: locks held on a dedicated database session per holder.

One strategy name, an implementation per database vendor (the registry,
:mod:`django_dlock.strategies`, says which):

* :mod:`~django_dlock.strategies.advisory.postgresql`: PostgreSQL
  session-level advisory locks (``pg_advisory_lock``);
* :mod:`~django_dlock.strategies.advisory.mysql`: MySQL/MariaDB user locks
  (``GET_LOCK``).

Both hold a holder's locks on a session of its own:
:mod:`~django_dlock.strategies.advisory.sessions` (one session, and the
connection model), :mod:`~django_dlock.strategies.advisory.sessions` (idle
sessions, holders that end without releasing, ``fork``),
:mod:`~django_dlock.strategies.advisory.sessions` (sessions the server ended),
:mod:`~django_dlock.strategies.advisory.sessions` and
:mod:`~django_dlock.strategies.advisory.acquire` (the async path), and
:mod:`~django_dlock.strategies.advisory.pending` (two-phase acquire).
"""
