"""Signals sent by django-dlock. Every signal is sent with ``sender=`` the
primitive's class and these keyword arguments:

* ``lock_acquired``: ``name``, ``strategy``, ``fence``, ``wait`` (seconds spent waiting)
* ``lock_released``: ``name``, ``strategy``, ``held`` (seconds held)
* ``lock_lost``: ``name``, ``strategy``, ``reason``
* ``lock_skipped``: ``name``, ``reason`` (a TaskLock or ``on_fail="skip"`` skipped a run)
* ``leader_changed``: ``name``, ``leader``, ``term``
* ``lock_force_released``: ``name``, ``owner`` (the holder it was taken from),
  ``fence``, ``using``, ``user`` (or ``None``), ``source`` (``"admin"`` or
  ``"command"``); sender is the ``Lock`` model
* ``lock_held_long``: ``name``, ``strategy``, ``held`` (seconds held so far),
  ``owner``: a renewal found the lease held longer than ``DLOCK_LONG_HOLD``
  (sent once per holding, from the thread that renewed it)
"""

from __future__ import annotations

from django.dispatch import Signal

lock_acquired = Signal()
lock_released = Signal()
lock_lost = Signal()
lock_skipped = Signal()
leader_changed = Signal()
lock_force_released = Signal()
lock_held_long = Signal()
