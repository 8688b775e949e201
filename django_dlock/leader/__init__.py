"""``LeaderElection``: exactly one process of many acts as the leader.

Kubernetes leader-election semantics on the site's own database::

    election = dlock.LeaderElection("scheduler", lease=15, renew_deadline=10, retry=2)

    def lead(leadership):                      # called on this process's terms
        while not leadership.wait(60):         # True once leadership ends
            run_the_schedule(fence=leadership.term)

    election.run(lead)                         # blocks; SIGTERM/SIGINT step down

* Every candidate tries to take the election's lease (a row of the ``Lock``
  table named ``leader:<name>``) every ``retry`` seconds (sooner when the
  lease is about to end, at once on PostgreSQL when the leader releases it:
  ``LISTEN/NOTIFY``). The winner leads for ``lease`` seconds and renews every
  ``retry`` seconds.
* **term**: each leadership gets the fencing number of its acquisition,
  strictly greater than every earlier term of the election.
* **renew_deadline**: a leader that has not renewed successfully for
  ``renew_deadline`` seconds (counted from the *start* of its last
  successful renewal, so before the database could have ended the lease)
  stops leading at once, even while a renewal is still hanging. The lease
  then still has ``lease - renew_deadline`` seconds to run: that is the
  margin the leader's work has to notice and stop before anyone else can
  lead.
* **graceful stop** (:meth:`LeaderElection.stop`, SIGTERM/SIGINT in
  :meth:`LeaderElection.run`, the end of ``with``): the running target is
  told to finish, then the lease is released at once, so a standby takes
  over within about one ``retry`` interval (at once on PostgreSQL).
* ``strategy="advisory"`` (PostgreSQL) holds a session-level advisory lock
  as the source of truth, so a killed leader is replaced as soon as its
  connection ends; the lease row still records the leader and its term.

Identity is per process (the worker: host and pid, or ``identity=``), never
per thread: any thread of the process sees the same ``is_leader``.
"""

from django_dlock.leader.election import LeaderElection
from django_dlock.leader.isolation import TargetDied
from django_dlock.leader.leadership import (
    STEPPING_DOWN,
    LeaderRecord,
    Leadership,
    current_leadership,
)

__all__ = [
    "STEPPING_DOWN",
    "LeaderElection",
    "LeaderRecord",
    "Leadership",
    "TargetDied",
    "current_leadership",
]
