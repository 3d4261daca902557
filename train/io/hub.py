"""Hugging Face Hub model ids where an HF model directory is accepted (``import-hf``,
``--init-from``, ``generate --hf``, ``eval --hf``).

A name that is no local path and reads as a Hub id (``NAME`` or ``ORG/NAME``, optionally
``@REVISION``) is resolved to its snapshot directory by ``huggingface_hub.snapshot_download``,
which reads the cache (``HF_HUB_CACHE``/``HF_HOME``), honours ``HF_HUB_OFFLINE`` (the cache only)
and ``HF_TOKEN`` (private and gated models), and fetches only what shardzoo reads: configs,
safetensors and tokenizer files. A Hub that cannot be reached within a few seconds is not waited
for: the cache is tried alone. A model that cannot be had is one line naming the id.
"""

from __future__ import annotations

import contextlib
import os
import re

from shardzoo.errors import UserError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w./-]+)?$")
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubError(UserError):
    """A Hub model id that cannot be resolved (not cached offline, unknown, gated, unreachable)."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is taken as a Hub model id: no existing path, and of the form
    ``[ORG/]NAME[@REVISION]`` (a path starting with ``/``, ``.`` or ``~`` never is)."""
    name = str(name)
    return not os.path.exists(os.path.expanduser(name)) and bool(HUB_ID.match(name)) \
        and not name.startswith((".", "~"))


@contextlib.contextmanager
def _offline():
    from huggingface_hub import constants

    saved = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = saved


def resolve_model_dir(name: str, what: str) -> str:
    """``name`` itself, or, for a Hub id (``is_hub_id``), the local snapshot directory of that
    model; ``what`` names the flag in the one-line error."""
    if not is_hub_id(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from shardzoo.data.sources import hub_reachable

    repo, _, revision = str(name).partition("@")
    offline = bool(constants.HF_HUB_OFFLINE)
    unreachable = not offline and not hub_reachable()
    try:
        with _offline() if unreachable else contextlib.nullcontext():
            return snapshot_download(repo, revision=revision or None, allow_patterns=MODEL_FILES)
    except Exception as e:  # noqa: BLE001 - the id, the network, the token or the cache: all the user's
        where = f"{what} {name}: no such directory, and as a Hugging Face Hub model id"
        if isinstance(e, LocalEntryNotFoundError) or unreachable:
            why = ("HF_HUB_OFFLINE is set" if offline else f"the Hub at {constants.ENDPOINT} cannot be reached")
            raise HubError(f"{where} it is not in the cache {constants.HF_HUB_CACHE} and {why}: "
                           "download it once with network access, or give a local directory") from None
        if isinstance(e, GatedRepoError):
            raise HubError(f"{where} it is gated: accept its terms on the Hub and set HF_TOKEN") from None
        if isinstance(e, RepositoryNotFoundError):
            token = "" if os.environ.get("HF_TOKEN") else " (for a private model, set HF_TOKEN)"
            raise HubError(f"{where} it does not exist on the Hub{token}") from None
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HubError(f"{where} it cannot be downloaded: {reason}") from None
