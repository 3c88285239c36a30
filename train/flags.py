"""Every script's argument parser (train/startup.py builds the flag dataclasses' on it; train/launch_local.py, which
starts no JAX, uses it alone): a flag is spelt whole, a mistake is one line naming the closest flag."""

import argparse
import difflib
import re


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each flag's default after its help, unless the help
    already says it or there is none ("" or None: unset, the help says what that means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS) or action.option_strings == []:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every script's parser: a flag is spelt whole (no prefix matching: `--step 3` is not `--steps 3`), and a
    mistake is argparse's one line without the usage block, an unknown flag naming the closest one there is."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            given = [w.partition("=")[0] for w in unknown.group(1).split() if w.startswith("-")]
            close = [m for w in given for m in difflib.get_close_matches(w, flags, n=1, cutoff=0.6)]
            message += f" (did you mean {', '.join(dict.fromkeys(close))}?)" if close else " (--help lists the flags)"
        self.exit(2, f"error: {message}\n")
