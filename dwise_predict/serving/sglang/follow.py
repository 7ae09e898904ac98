"""Hot swap: the hook follows a zoo name or a bundle directory and serves each new verified bundle
from a step boundary on, without a restart, and rolls back a version the live monitor finds worse.

Two parts, one per thread:

- :class:`BundleFollower`, a daemon thread of the scheduler process: every ``poll_s`` seconds it looks
  at the zoo's index for the latest version of a name (``zoo`` given: :mod:`dwise_predict.bundles.zoo`,
  the reading side of a zoo; the runtime never imports ``exports``) or at a bundle directory's sealed
  ``bundle.json`` (no ``zoo``). A new one is pulled (its tar's sha256, the screen) or copied into a
  private cache directory, loaded with the one loader (``load_bundle``: hashes, screen, probes) on the
  serving bundle's device and backend, and held to the serving bundle: the same hidden size (the
  pooling buffers are that wide) and model, and the decoding SGLang serves (``check_compatible``,
  as the hook holds its first bundle on its first step: algorithm and parameters where we mirror
  the algorithm, the block size always). ``K`` (the refinement graph's horizon) may differ: nothing
  the hook allocated depends on it. A bundle refused is logged once, with why, and never offered
  again; an accepted one waits in a one-slot mailbox (:meth:`BundleFollower.ready`), a newer one
  replacing it there. Every file read, every load and every check runs here, never on SGLang's
  scheduler thread. The thread starts on the scheduler's first step (the decoding SGLang serves is
  known then), dies with the process, and stops with ``uninstall``.
- :class:`HotSwap`, on the scheduler thread at the top of each step (``DwiseHook.swap_if_ready``):
  takes the mailbox's bundle (``DwiseHook.swap``: the hook's and its request table's bundle, the
  buffers' ``prompt_mean``; every estimate the policy holds stays), and puts the new version on
  probation. The bundle it replaced is kept; once the monitor has seen ``rollback_after`` finished
  requests that the new version estimated, a refined ρ below the old version's (as the monitor had
  it at the swap) by more than ``rollback_margin`` swaps the old one back and rejects the new
  version for good. One comparison per version, a few monitor reads per swap: O(1) per step.

Version names: the zoo's version when following a zoo (the version whose published ``bundle.json``
is the serving bundle's own, for the bundle the server started with), else the manifest seal's first
12 hex digits (:func:`bundle_version`).

Parallel ranks: each scheduler process follows on its own. TP ranks of one batch use the first
rank's estimates (``requests._RankShare``), so only that rank's bundle ranks requests, whatever the
other ranks hold; DP ranks each swap when their own follower sees the new version, so for up to
``poll_s`` seconds (plus a load) different DP ranks may serve different versions, and each rank's
recording lists its own swaps.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from dwise_predict.errors import BundleError, DwiseError, InputError
from dwise_predict.bundles.load import check_compatible, load_bundle
from dwise_predict.bundles.manifest import (BUNDLE_ARTIFACTS, BUNDLE_FILE, MANIFEST_MAX_BYTES, SEAL_KEY,
                                            canonical_json)
from dwise_predict.bundles.zoo import find_entry, list_entries, published_manifest, pull
from dwise_predict.names import MODEL_KEYS

logger = logging.getLogger(__name__)
VERSION_HEX = 12  # the seal's hex digits that name a version outside a zoo
STOP_WAIT_S = 10.0  # how long uninstall waits for a poll under way (a load) to end


def bundle_version(bundle) -> str:
    """The version name of ``bundle`` outside a zoo: its manifest seal's first :data:`VERSION_HEX`
    hex digits ("none" without a bundle)."""
    if bundle is None:
        return "none"
    return str(bundle.manifest.raw.get(SEAL_KEY, ""))[:VERSION_HEX]


@dataclass(frozen=True)
class Following:
    """What the hook follows and how it judges a new version (``install(follow=)``).

    source : a bundle name in ``zoo`` (its latest version), or (``zoo`` None) a bundle directory.
    zoo : a zoo directory, or None.
    poll_s : seconds between two looks.
    rollback_after : requests of a new version the monitor must have seen finish before it is
        compared with the old one (0: never rolled back).
    rollback_margin : how far its refined ρ may fall below the old version's before it is rolled back.
    """

    source: str
    zoo: str | None = None
    poll_s: float = 10.0
    rollback_after: int = 64
    rollback_margin: float = 0.1


class BundleFollower:
    """Watches for a new version of the serving bundle and loads it in the background.

    serving : the :class:`~dwise_predict.bundles.load.LoadedBundle` the hook starts with (what a
        new one is held to; its device and backend are the new one's).
    follow : a bundle name in ``zoo``, or (``zoo`` None) a bundle directory to watch.
    zoo : a zoo directory, or None.
    poll_s : seconds between two looks.

    ``version`` names the serving bundle at the start; ``refused`` maps each version never to offer
    to why.
    """

    def __init__(self, serving, follow: str, zoo: str | None = None, poll_s: float = 10.0):
        self.serving, self.follow, self.poll_s = serving, str(follow), float(poll_s)
        self.zoo = None if zoo is None else Path(zoo)
        self.source = f"{self.follow} in the zoo {self.zoo}" if self.zoo is not None else f"the directory {self.follow}"
        self.own_manifest = canonical_json(serving.manifest.raw)  # sealed manifests are canonical: their bytes
        self.version = self._starting_version()
        self.current = self.version  # the version last offered (or the starting one): not offered again
        self.refused: dict[str, str] = {}
        self.served = None  # the decoding SGLang serves, set by start
        self.seen = self.own_manifest  # directory mode: the bundle.json bytes last handled
        self.last_failure = None  # the last poll's failure, logged once
        self.cache = Path(tempfile.mkdtemp(prefix="dwise-follow-"))
        self._slot = None  # the mailbox: (bundle, version) or None
        self._mailbox, self._polling, self._stop = threading.Lock(), threading.Lock(), threading.Event()
        self._thread = None

    def _starting_version(self) -> str:
        """The zoo version whose published manifest is the serving bundle's, newest first; else its
        seal's digits (a bundle the zoo does not hold, or a directory followed)."""
        if self.zoo is not None:
            entries = [e for e in list_entries(self.zoo) if e["name"] == self.follow]
            for entry in reversed(entries):
                if published_manifest(self.zoo, entry) == self.own_manifest:
                    return entry["version"]
        return bundle_version(self.serving)

    # --- the thread ------------------------------------------------------------------------------------

    def start(self, served: dict) -> None:
        """Start polling, holding new bundles to ``served`` (the decoding SGLang serves:
        ``engine.algorithms.served_decoding`` of the scheduler's ``DllmConfig``)."""
        self.served = served
        self._thread = threading.Thread(target=self._run, name=f"dwise-follow {self.follow}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (waiting up to :data:`STOP_WAIT_S` for a poll under way) and remove the cache."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_WAIT_S)
        if self._thread is None or not self._thread.is_alive():
            shutil.rmtree(self.cache, ignore_errors=True)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception as err:  # whatever a poll meets: logged once; the server serves on, the next poll retries
                self._failed(f"{type(err).__name__}: {err}")
        shutil.rmtree(self.cache, ignore_errors=True)

    # --- one look --------------------------------------------------------------------------------------

    def poll(self) -> str | None:
        """Look once; return the version put in the mailbox, or None. A file or a zoo that cannot be
        read is logged (once until it changes) and looked at again at the next poll; a bundle
        refused is remembered (:attr:`refused`). One poll at a time (the thread's, or a caller's)."""
        with self._polling:
            if self.served is None or self._stop.is_set():
                return None
            found = self._from_zoo() if self.zoo is not None else self._from_directory()
            if found is None:
                return None
            bundle, version = found
            if version == self.current or version in self.refused:
                return None
            why = self.incompatibility(bundle)
            if why is not None:
                self.refuse(version, why)
                return None
            with self._mailbox:
                self._slot = (bundle, version)
            self.current = version
            logger.info("dwise: bundle %s from %s loaded and checked; the hook serves it from its next step",
                        version, self.source)
            return version

    def _from_zoo(self):
        """The latest version of the name, loaded (None: none new, or it failed)."""
        try:
            entry = find_entry(self.zoo, self.follow)
        except InputError:
            return None  # nothing published under the name yet
        version = entry["version"]
        if version == self.current or version in self.refused:
            return None
        out = self.cache / f"zoo-{version}"
        try:
            pull(self.zoo, f"{self.follow}@{version}", out)
            return load_bundle(out, device=self.serving.device, backend=self.serving.backend), version
        except BundleError as err:  # a published tar never changes: its version is refused for good
            self.refuse(version, str(err))
        except (DwiseError, OSError) as err:  # the zoo unreadable for now (a mount, a lock): tried again
            self._failed(str(err))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        return None

    def _from_directory(self):
        """The watched directory's bundle once its sealed manifest changed, loaded from a private copy
        (None: unchanged, or it failed: a directory being written is tried again at the next poll)."""
        directory = Path(self.follow)
        manifest = directory / BUNDLE_FILE
        try:
            if not manifest.is_file() or manifest.is_symlink() or manifest.stat().st_size > MANIFEST_MAX_BYTES:
                return None
            raw = manifest.read_bytes()
            if raw == self.seen:
                return None
            out = Path(tempfile.mkdtemp(prefix="directory-", dir=self.cache))
            for name in (BUNDLE_FILE, *BUNDLE_ARTIFACTS):  # the names a bundle may hold; links are left behind
                if (directory / name).is_file() and not (directory / name).is_symlink():
                    shutil.copyfile(directory / name, out / name)
            try:
                bundle = load_bundle(out, device=self.serving.device, backend=self.serving.backend)
            finally:
                shutil.rmtree(out, ignore_errors=True)
        except (DwiseError, OSError) as err:
            self._failed(f"{directory}: {err}")
            return None
        self.seen = raw  # the bytes, not the copy's: a directory that changed again is looked at again
        return bundle, bundle_version(bundle)

    def incompatibility(self, bundle) -> str | None:
        """Why ``bundle`` cannot replace the serving one in this server, or None."""
        serving = self.serving
        if bundle.hidden_size != serving.hidden_size:
            return (f"its hidden size is {bundle.hidden_size} but the serving bundle's is {serving.hidden_size} "
                    "(the hook's pooling buffers are that wide): export a bundle for the served model")
        from dwise_predict.engine.algorithms import comparable_decoding  # torch: not at import

        identity = bundle.manifest.identity
        model = {key: getattr(serving.manifest.identity.model, key) for key in MODEL_KEYS}
        try:
            check_compatible(identity, model, comparable_decoding(identity.decoding.algorithm, self.served),
                             str(bundle.path))
        except BundleError as err:
            return str(err)
        return None

    def refuse(self, version: str, why: str) -> None:
        """Never offer ``version`` again; say why, once."""
        if version not in self.refused:
            self.refused[version] = why
            logger.warning("dwise: not serving bundle %s from %s: %s", version, self.source, " ".join(why.split()))

    def _failed(self, why: str) -> None:
        if why != self.last_failure:
            self.last_failure = why
            logger.warning("dwise: following %s: %s (looked at again in %g s)", self.source, " ".join(why.split()),
                           self.poll_s)

    # --- the scheduler thread's side -----------------------------------------------------------------

    def ready(self):
        """``(bundle, version)`` once for each bundle accepted since the last call, else None (one
        attribute read when there is none: the scheduler asks every step)."""
        if self._slot is None:
            return None
        with self._mailbox:
            offer, self._slot = self._slot, None
        return offer


class HotSwap:
    """The hook's side of following, on the scheduler thread: swap at a step boundary, roll back.

    follower : the :class:`BundleFollower`.
    rollback_after, rollback_margin : :class:`Following`'s.
    """

    def __init__(self, follower: BundleFollower, rollback_after: int = 64, rollback_margin: float = 0.1):
        self.follower, self.rollback_after, self.rollback_margin = follower, int(rollback_after), float(rollback_margin)
        self.previous = None  # (bundle, version) the last swap replaced, while the new version is on probation
        self.baseline = None  # the replaced version's refined ρ on the monitor at the swap (None: too few)
        self.check_at = None  # the hook's finished count at which the probation is next looked at

    @classmethod
    def of(cls, serving, follow: Following) -> HotSwap:
        """Following ``follow`` from the bundle ``serving`` (the follower reads the zoo's index now)."""
        follower = BundleFollower(serving, follow.source, follow.zoo, follow.poll_s)
        return cls(follower, follow.rollback_after, follow.rollback_margin)

    def step(self, hook) -> None:
        """At the top of a scheduler step: judge a version on probation when due, then take the
        follower's new bundle, if any."""
        if self.check_at is not None and hook.stats.finished >= self.check_at:
            self.judge(hook)
        offer = self.follower.ready()
        if offer is not None:
            self.swap(hook, *offer)

    def swap(self, hook, bundle, version: str) -> None:
        """Serve ``bundle`` and put ``version`` on probation against the version it replaces."""
        previous = (hook.bundle, hook.bundle_version)
        hook.swap(bundle, version, f"new version in {self.follower.source}")
        monitor = hook.monitor
        if self.rollback_after and monitor is not None:
            self.previous, self.baseline = previous, monitor.quality(previous[1])[1]
            self.check_at = hook.stats.finished + self.rollback_after
        else:
            self.previous = self.baseline = self.check_at = None

    def judge(self, hook) -> None:
        """Keep the new version, or swap the old one back when the monitor says it ranks worse."""
        version = hook.bundle_version
        n, rho = hook.monitor.quality(version)
        if n < self.rollback_after:  # some requests that finished were the old version's: wait for the rest
            self.check_at = hook.stats.finished + self.rollback_after - n
            return
        self.check_at = None
        old_bundle, old_version = self.previous
        old = self.baseline if self.baseline is not None else hook.monitor.quality(old_version)[1]
        self.previous = self.baseline = None
        if rho is None or old is None:
            logger.info("dwise: keeping bundle %s: the monitor holds too few refined requests of it or of %s to "
                        "compare them", version, old_version)
            return
        if rho >= old - self.rollback_margin:
            logger.info("dwise: keeping bundle %s: refined rho %.3f over %d requests, %s had %.3f", version, rho, n,
                        old_version, old)
            return
        why = (f"rollback: refined rho {rho:.3f} over {n} requests of {version}, below {old_version}'s {old:.3f} by "
               f"more than {self.rollback_margin:g}")
        hook.swap(old_bundle, old_version, why)
        hook.stats.rollbacks += 1
        self.follower.refuse(version, why)


__all__ = ["BundleFollower", "Following", "HotSwap", "bundle_version"]
