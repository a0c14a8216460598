"""The help format both command lines share (the client's ``kiviq`` and
``kiviq worker``, which never import each other)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in the help, except where the help text already
    says the default (options whose default is None say it in words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is None:
            return text
        if action.default is False and action.nargs == 0:  # store_true
            return text + " (default: off)"
        return super()._get_help_string(action)
