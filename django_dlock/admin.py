"""Admin for lease locks, and a read-only page of PostgreSQL advisory locks.

* The lock list shows each lease with a state badge (held / expired /
  released) and the time left, both judged on the database clock.
* "Force-release selected locks" (permission
  ``django_dlock.force_release_lock``) ends the selected leases after a
  confirmation page: one ``LogEntry`` per lock, the ``lock_force_released``
  signal, and on PostgreSQL a ``NOTIFY`` that wakes the waiters.
* "Delete selected expired or released locks" (permission
  ``django_dlock.delete_lock``) deletes, after a confirmation page, the
  selected rows whose lease has ended on the database clock, with the
  batches of :mod:`django_dlock.cleanup` (never a held lease).
* A lock's page shows its times to the second with the time zone, and
  "Force release…" opens the same confirmation as the list action, whose
  form runs that action.
* On PostgreSQL, "Advisory locks" lists the advisory locks held or awaited
  in the database, with their lock names where they can be known
  (:func:`django_dlock.operations.advisory_names`); a superuser can end the
  session of a holder (on a row that holds a lock) after a confirmation
  (``pg_terminate_backend``).

Locks cannot be added or edited here, and full tokens are never shown: the
list shows a short prefix, and no URL lookup may filter on the token
(``?token__startswith=`` would otherwise let a view-only user recover a
holder's token one character at a time).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db import connections
from django.db.models import Q, QuerySet
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from django_dlock import cleanup, dbclock
from django_dlock import operations as override
from django_dlock.dbclock import DbNow
from django_dlock.models import Lock, Waiter
from django_dlock.strategies import queue

#: badge colours: (text, background)
BADGES = {
    "held": ("#155724", "#d4edda", "●"),
    "waiting": ("#004085", "#cce5ff", "◔"),
    "expired": ("#856404", "#fff3cd", "◌"),
    "released": ("#383d41", "#e2e3e5", "○"),
    "held long": ("#721c24", "#f8d7da", "⚠"),
}


def badge(state: str) -> SafeString:
    """A coloured state badge (inline styles: no static files needed)."""
    color, background, mark = BADGES[state]
    return format_html(
        '<span class="dlock-state dlock-state-{}" style="display:inline-block;'
        "padding:1px 8px;border-radius:9px;font-weight:600;white-space:nowrap;"
        'color:{};background:{}">{} {}</span>',
        state,
        color,
        background,
        mark,
        state,
    )


def duration(seconds: float) -> str:
    """``3 h 05 min``, ``4 min 09 s``, ``12 s``."""
    seconds = int(round(abs(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"


def compact(value: dt.datetime | None) -> str:
    """``2024-05-01 14:03:07`` in the current time zone (``—`` for none)."""
    if value is None:
        return "—"
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return value.strftime("%Y-%m-%d %H:%M:%S")


def exact(value: dt.datetime | None) -> str:
    """``2024-05-01 14:03:07 UTC``: to the second, with the time zone (``—`` for none)."""
    if value is None:
        return "—"
    if timezone.is_aware(value):
        value = timezone.localtime(value)
        zone = value.strftime("%Z") or value.strftime("UTC%z")
        return f"{compact(value)} {zone}"
    return compact(value)


#: fields no admin URL may filter, search or sort on
SECRET_FIELDS = frozenset({"token"})


class StateFilter(admin.SimpleListFilter):
    """Held / expired / released, judged on the database clock."""

    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("held", "held"),
            ("expired", "expired (never released)"),
            ("released", "released"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Lock]) -> QuerySet[Lock]:
        value = self.value()
        if value == "held":
            return queryset.filter(expire_at__gt=DbNow())
        if value == "expired":
            return queryset.filter(expire_at__lte=DbNow()).exclude(token="")
        if value == "released":
            return queryset.filter(Q(expire_at__lte=DbNow()) & Q(token=""))
        return queryset


@admin.register(Lock)
class LockAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    # Fits a 1,280 px window with Django's navigation sidebar open: the expiry
    # time and the token prefix are on the detail page; long names wrap.
    list_display = (
        "name",
        "state",
        "owner",
        "fence",
        "acquired",
        "time_left",
    )
    list_filter = (StateFilter,)
    search_fields = ("name", "owner")
    ordering = ("name",)
    list_per_page = 100
    show_full_result_count = False
    actions = ["force_release", "delete_expired"]
    fields = (
        "name",
        "state",
        "owner",
        "fence",
        "token_start",
        "acquired_at_exact",
        "expire_at_exact",
        "time_left",
        "waiters",
    )
    readonly_fields = fields

    # -- permissions: view, force-release and cleanup; never add/change/delete a row

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Deleting a held row by hand would lose its fencing history; free
        # rows go through "Delete selected expired or released locks"
        # (django_dlock.cleanup).
        # Without it Django also drops its "delete selected" action.
        return False

    def has_force_release_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_dlock.force_release_lock"))

    def has_delete_expired_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm("django_dlock.delete_lock"))

    # -- list ------------------------------------------------------------------

    def lookup_allowed(self, lookup: str, value: str, request: Any = None) -> bool:
        """Refuse every URL lookup that reaches the token (a token is a capability).

        Django allows lookups on a model's own fields by default; on the token
        that is an oracle. The admin answers such a URL with "400 Bad Request".
        """
        if any(part.lower() in SECRET_FIELDS for part in lookup.split("__")):
            return False
        if request is None:  # Django < 5.0 has no request argument
            return bool(super().lookup_allowed(lookup, value))  # type: ignore[call-arg]
        return bool(super().lookup_allowed(lookup, value, request))

    def get_queryset(self, request: HttpRequest) -> QuerySet[Lock]:
        return override.annotate_state(super().get_queryset(request))

    @admin.display(description="state", ordering="expire_at")
    def state(self, obj: Lock) -> SafeString:
        held = bool(obj.db_held)  # type: ignore[attr-defined]
        shown = badge(override.state_of(held, obj.token))
        seconds = override.held_for(obj)
        if override.is_held_long(held, seconds):  # DLOCK_LONG_HOLD
            assert seconds is not None
            return format_html(
                '{}<br><span title="held for {}, longer than DLOCK_LONG_HOLD">{}</span>',
                shown,
                duration(seconds),
                badge("held long"),
            )
        return shown

    @admin.display(description="time left", ordering="expire_at")
    def time_left(self, obj: Lock) -> str:
        left = float(obj.db_seconds_left or 0.0)  # type: ignore[attr-defined]
        if obj.db_held:  # type: ignore[attr-defined]
            return f"{duration(left)} left"
        return f"ended {duration(left)} ago"

    @admin.display(description="acquired", ordering="acquired_at")
    def acquired(self, obj: Lock) -> str:
        if obj.acquired_at is None:
            return "—"
        day, _, clock = compact(obj.acquired_at).partition(" ")
        return format_html('<span style="white-space:nowrap">{}<br>{}</span>', day, clock)

    @admin.display(description=Lock._meta.get_field("acquired_at").verbose_name)
    def acquired_at_exact(self, obj: Lock) -> str:
        return exact(obj.acquired_at)

    @admin.display(description=Lock._meta.get_field("expire_at").verbose_name)
    def expire_at_exact(self, obj: Lock) -> str:
        return exact(obj.expire_at)

    @admin.display(description="token")
    def token_start(self, obj: Lock) -> str:
        return override.token_prefix(obj.token) or "—"

    @admin.display(description="waiters")
    def waiters(self, obj: Lock) -> str:
        """The key's queue (lease strategy), in the order it will be served."""
        found = queue.waiters(obj._state.db or "default", [obj.name])
        live = [row for row in found if row[4]]
        if not live:
            return "nobody waits"
        rows = format_html_join(
            "",
            "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (position, owner or "—", exact(since))
                for position, (_name, _ticket, owner, since, _live) in enumerate(live, 1)
            ),
        )
        return format_html(
            "<table><thead><tr><th>position</th><th>owner</th><th>waiting since</th></tr>"
            "</thead><tbody>{}</tbody></table>",
            rows,
        )

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        alias = override.default_alias()
        context = {
            **(extra_context or {}),
            **self._clock_context(alias),
            "dlock_advisory": {"postgresql": "PostgreSQL", "mysql": "MySQL/MariaDB"}.get(
                connections[alias].vendor, ""
            ),
        }
        return super().changelist_view(request, extra_context=context)

    def _clock_context(self, alias: str) -> dict[str, Any]:
        connection = connections[alias]
        with connection.cursor() as cur:
            cur.execute(f"SELECT {dbclock.now_sql(connection)}", [])
            row = cur.fetchone()
        db_now = row[0] if row else None
        if isinstance(db_now, str):  # SQLite returns text
            db_now = dt.datetime.fromisoformat(db_now).replace(tzinfo=dt.timezone.utc)
        if isinstance(db_now, dt.datetime) and timezone.is_naive(db_now):
            db_now = db_now.replace(tzinfo=dt.timezone.utc)
        skew = None
        if isinstance(db_now, dt.datetime):
            skew = (timezone.now() - db_now).total_seconds()
        return {"dlock_db_now": db_now, "dlock_skew": skew}

    # -- actions -----------------------------------------------------------------

    @admin.action(description="Force-release selected locks", permissions=["force_release"])
    def force_release(self, request: HttpRequest, queryset: QuerySet[Lock]) -> Any:
        if request.POST.get("post") != "yes":
            return self._confirm_force_release(request, queryset)
        objects = {obj.pk: obj for obj in queryset}
        released = override.force_release(
            queryset.db, pks=list(objects), user=request.user, source="admin"
        )
        for item in released:
            obj = objects[item.pk]
            self.log_change(
                request,
                obj,
                f"Force-released (was held by {item.owner or 'unknown'}, fence {item.fence}).",
            )
        if released:
            names = ", ".join(item.name for item in released)
            self.message_user(
                request,
                f"Force-released {len(released)} lock{'s' if len(released) != 1 else ''}: "
                f"{names}. Their holders will see LockLost on their next renew or release.",
                messages.SUCCESS,
            )
        skipped = len(objects) - len(released)
        if skipped:
            self.message_user(
                request,
                f"{skipped} selected lock{'s were' if skipped != 1 else ' was'} already "
                "released (nothing to do).",
                messages.WARNING,
            )
        return None

    def _confirm_force_release(
        self, request: HttpRequest, queryset: QuerySet[Lock], obj: Lock | None = None
    ) -> Any:
        """The confirmation page; its form posts the action to the lock list.

        From a lock's own page (``obj``) it is the same page and the same
        action: the form's target is the list, whose action runs it.
        """
        opts = self.model._meta
        rows = [
            {
                "obj": obj,
                "state": self.state(obj),
                "time_left": self.time_left(obj),
                "token": self.token_start(obj),
            }
            for obj in queryset
        ]
        context = {
            **self.admin_site.each_context(request),
            "title": "Force-release locks: are you sure?",
            "opts": opts,
            "original": obj,
            "form_url": "" if obj is None else self._changelist_url(),
            "rows": rows,
            "queryset": queryset,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/django_dlock/lock/force_release_confirmation.html", context
        )

    @admin.action(
        description="Delete selected expired or released locks", permissions=["delete_expired"]
    )
    def delete_expired(self, request: HttpRequest, queryset: QuerySet[Lock]) -> Any:
        """Delete the selected rows whose lease has ended, after a confirmation page.

        Which rows have ended is judged by the database when it deletes
        (``expire_at`` against its own now): a lease held or taken again by
        then is kept, and so is a free row whose key has live waiters.
        """
        if request.POST.get("post") != "yes":
            return self._confirm_delete_expired(request, queryset)
        before = dict(queryset.values_list("pk", "name"))
        deleted = cleanup.delete_free_rows(queryset.db, list(before))
        left = set(
            Lock.objects.using(queryset.db).filter(pk__in=list(before)).values_list("pk", flat=True)
        )
        gone = sorted(name for pk, name in before.items() if pk not in left)
        if deleted:
            self.message_user(
                request,
                f"Deleted {deleted} expired or released lock{'s' if deleted != 1 else ''}: "
                f"{', '.join(gone)}.",
                messages.SUCCESS,
            )
        kept = len(left)
        if kept:
            self.message_user(
                request,
                f"{kept} selected lock{'s were' if kept != 1 else ' was'} kept: "
                "held, or waited for.",
                messages.WARNING,
            )
        return None

    def _confirm_delete_expired(self, request: HttpRequest, queryset: QuerySet[Lock]) -> Any:
        objects = list(queryset)
        waited = set(
            Waiter.objects.using(queryset.db)
            .filter(name__in=[obj.name for obj in objects], expire_at__gt=DbNow())
            .values_list("name", flat=True)
        )
        doomed, kept = [], []
        for obj in objects:
            row = {"obj": obj, "state": self.state(obj), "time_left": self.time_left(obj)}
            if obj.db_held:  # type: ignore[attr-defined]
                kept.append({**row, "why": "held"})
            elif obj.name in waited:
                kept.append({**row, "why": "waiters queued for it"})
            else:
                doomed.append(row)
        context = {
            **self.admin_site.each_context(request),
            "title": "Delete expired or released locks: are you sure?",
            "opts": self.model._meta,
            "doomed": doomed,
            "kept": kept,
            "queryset": queryset,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "media": self.media,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(
            request, "admin/django_dlock/lock/delete_expired_confirmation.html", context
        )

    # -- a lock's own page -----------------------------------------------------------

    def _changelist_url(self) -> str:
        info = (self.admin_site.name, self.model._meta.app_label, self.model._meta.model_name)
        return reverse("{}:{}_{}_changelist".format(*info))

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        """The read-only lock page, with "Force release…" while a token is set."""
        context = dict(extra_context or {})
        obj = self.get_object(request, unquote(object_id))
        if obj is not None and obj.token and self.has_force_release_permission(request):
            info = (self.admin_site.name, self.model._meta.app_label, self.model._meta.model_name)
            context["dlock_force_release_url"] = reverse(
                "{}:{}_{}_force_release".format(*info), args=[quote(obj.pk)]
            )
        return super().change_view(request, object_id, form_url, extra_context=context)

    def force_release_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """A lock's "Force release…": the list action's confirmation page for this lock."""
        if request.method != "GET":
            return HttpResponseNotAllowed(["GET"])
        if not self.has_force_release_permission(request):
            raise PermissionDenied
        obj = self.get_object(request, unquote(object_id))
        if obj is None:
            raise Http404(f"No lock with the primary key {object_id!r}.")
        queryset = self.get_queryset(request).filter(pk=obj.pk)
        return self._confirm_force_release(request, queryset, obj)  # type: ignore[no-any-return]

    # -- advisory locks (PostgreSQL) ---------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        info = (self.model._meta.app_label, self.model._meta.model_name)
        urls = [
            path(
                "<path:object_id>/force-release/",
                self.admin_site.admin_view(self.force_release_view),
                name="{}_{}_force_release".format(*info),
            ),
            path(
                "advisory/",
                self.admin_site.admin_view(self.advisory_view),
                name="{}_{}_advisory".format(*info),
            ),
            path(
                "waiting/",
                self.admin_site.admin_view(self.waiting_view),
                name="{}_{}_waiting".format(*info),
            ),
            path(
                "advisory/terminate/<int:pid>/",
                self.admin_site.admin_view(self.terminate_view),
                name="{}_{}_terminate".format(*info),
            ),
        ]
        return urls + super().get_urls()

    def _page(self, request: HttpRequest, title: str, **extra: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            **extra,
        }

    def advisory_view(self, request: HttpRequest) -> HttpResponse:
        """Read-only list of the advisory locks held or awaited (PostgreSQL)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        alias = override.default_alias()
        postgresql = override.is_postgresql(alias)
        locks = override.advisory_locks(alias) if postgresql else []
        find = request.GET.get("name", "").strip()
        find_key = override.advisory_key_of_name(find) if find else None
        names = (
            override.advisory_names(alias, {lk.key for lk in locks}, [find] if find else [])
            if locks
            else {}
        )
        rows = [
            {
                "lock": lk,
                "name": names.get(lk.key, ""),
                "badge": badge(lk.state),
                "match": find_key is not None and lk.key == find_key,
            }
            for lk in locks
        ]
        context = self._page(
            request,
            "Advisory locks",
            rows=rows,
            postgresql=postgresql,
            vendor=connections[alias].vendor,
            alias=alias,
            find=find,
            find_key=(
                None
                if find_key is None
                else str(find_key[0])
                if len(find_key) == 1
                else f"({find_key[0]}, {find_key[1]})"
            ),
            can_terminate=request.user.is_superuser,
            held=sum(1 for lk in locks if lk.granted),
            waiting=sum(1 for lk in locks if not lk.granted),
            user_locks=override.user_locks(alias) if override.is_mysql(alias) else None,
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_dlock/lock/advisory_locks.html", context)

    def waiting_view(self, request: HttpRequest) -> HttpResponse:
        """Who waits on whom (read-only): each key with waiters, its holders and
        its queue in order; on PostgreSQL, each awaited advisory key, its holders
        and the backends blocking each waiter."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        alias = override.default_alias()
        leases, advisory = override.blocking_tree(alias)
        cycled = any(waiter.in_deadlock for key in leases for waiter in key.waiters)
        deadlocks = [
            {
                "victim": cycle.victim,
                "steps": [
                    (holder, key, cycle.keys[(i + 1) % len(cycle.keys)])
                    for i, (holder, key) in enumerate(zip(cycle.holders, cycle.keys, strict=True))
                ],
            }
            for cycle in (override.deadlocks(alias) if cycled else [])
        ]
        context = self._page(
            request,
            "Who waits on whom",
            leases=[
                {
                    "key": key,
                    "holders": [
                        {"lease": lease, "left": duration(lease.seconds_left)}
                        for lease in key.holders
                    ],
                }
                for key in leases
            ],
            advisory=advisory,
            deadlocks=deadlocks,
            alias=alias,
        )
        request.current_app = self.admin_site.name
        return TemplateResponse(request, "admin/django_dlock/lock/waiting.html", context)

    @staticmethod
    def _superuser_only(request: HttpRequest) -> None:
        if not request.user.is_superuser:
            raise PermissionDenied

    def terminate_view(self, request: HttpRequest, pid: int) -> HttpResponse:
        """Confirm (GET), then end (POST) the session of an advisory-lock holder."""
        if request.method not in ("GET", "POST"):
            return HttpResponseNotAllowed(["GET", "POST"])
        return _terminate(self, request, pid)


def _terminate(model_admin: LockAdmin, request: HttpRequest, pid: int) -> HttpResponse:
    model_admin._superuser_only(request)
    alias = override.default_alias()
    if not override.is_postgresql(alias):
        raise PermissionDenied
    advisory_url = reverse(f"{model_admin.admin_site.name}:django_dlock_lock_advisory")
    locks = [lk for lk in override.advisory_locks(alias) if lk.pid == pid]
    names = override.advisory_names(alias, {lk.key for lk in locks}) if locks else {}
    if request.method == "POST":
        if request.POST.get("post") == "yes" and override.terminate_backend(
            alias, pid, user=request.user
        ):
            model_admin.message_user(
                request,
                f"Terminated PostgreSQL backend {pid}: its advisory locks are released.",
                messages.SUCCESS,
            )
        else:
            model_admin.message_user(
                request,
                f"Backend {pid} holds or awaits no advisory lock any more; nothing was done.",
                messages.WARNING,
            )
        return HttpResponseRedirect(advisory_url)
    context = model_admin._page(
        request,
        f"Terminate PostgreSQL backend {pid}?",
        pid=pid,
        rows=[
            {"lock": lk, "name": names.get(lk.key, ""), "badge": badge(lk.state)} for lk in locks
        ],
        advisory_url=advisory_url,
    )
    request.current_app = model_admin.admin_site.name
    return TemplateResponse(request, "admin/django_dlock/lock/terminate_confirmation.html", context)
