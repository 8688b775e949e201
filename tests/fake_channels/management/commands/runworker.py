"""A stand-in for Django Channels' ``runworker`` command (the name is what matters)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser


class Command(BaseCommand):
    help = "Channels' runworker (a stand-in)"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("channels", nargs="*")

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write("the other app's runworker")
