"""The client side of the producer service (``service.py``): extraction requests spread over producer URLs.

``ProducerClient`` sends each ``POST /extract`` to the live producer with the fewest requests in flight. A producer
that refuses the connection, times out or answers 5xx raises ``ProducerUnavailable`` and is skipped for a while, so
its caller (``streaming.StreamingSource``) can send the sample to another one under a fresh key. A producer list file
(``--producers @FILE``) is reread while training runs, so producers can join and leave.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Set
from pathlib import Path
from urllib.parse import urlsplit

from specdraft.errors import SpecdraftError, setting

log = logging.getLogger(__name__)


class ProducerUnavailable(Exception):
    """A producer did not serve a request (down, timed out, or failed internally); try another."""

    def __init__(self, url: str, message: str):
        super().__init__(message)
        self.url = url


#: How often a producer list file (``--producers @FILE``) is reread.
MEMBERSHIP_REFRESH_S = 2.0


def _check_urls(urls: Iterable[str], where: str) -> list[str]:
    checked = []
    for url in urls:
        url = url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise SpecdraftError(f"producer URL {url!r} ({where}) is not http://HOST:PORT")
        checked.append(url)
    return checked


def read_producer_list(path: Path) -> list[str]:
    """Producer URLs in a list file: one per line; blank lines and ``#`` comments are skipped."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise SpecdraftError(f"cannot read the producer list {path} ({exc.strerror or exc})") from None
    return _check_urls((line for line in lines if line.strip() and not line.lstrip().startswith("#")), f"in {path}")


class ProducerClient:
    """Spreads extraction requests over several producer URLs (least in-flight first).

    A producer that fails is skipped for ``down_s`` seconds, then tried again. With ``membership``
    (a file of URLs, ``--producers @FILE``) the list is reread every ``refresh_s`` seconds:
    a URL added there joins once its health check shows the same target, one removed gets no new
    requests (those in flight finish), so producers can be added and retired while training runs.
    """

    def __init__(
        self,
        urls: Iterable[str],
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        down_s: float = 30.0,
        membership: str | Path | None = None,
        refresh_s: float = MEMBERSHIP_REFRESH_S,
    ):
        self.membership = Path(membership) if membership else None
        self.urls = read_producer_list(self.membership) if self.membership else _check_urls(urls, setting("producers"))
        if not self.urls:
            where = f"the producer list {self.membership}" if self.membership else setting("producers")
            raise SpecdraftError(
                f"no producer URLs given in {where}; pass {setting('producers')} http://HOST:PORT[,http://HOST:PORT...] or @FILE"
            )
        self.token = token
        self.timeout_s = timeout_s
        self.down_s = down_s
        self.refresh_s = refresh_s
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._last_refresh = time.monotonic()
        self._fingerprint: str | None = None
        self._inflight = dict.fromkeys(self.urls, 0)
        self._down: dict[str, tuple[float, str]] = {}  # url -> (since, reason)
        self._order = itertools.count()

    def _call(self, url: str, path: str, body: dict | None, timeout: float) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST")
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", "")
            except (ValueError, AttributeError):
                message = exc.reason
            if exc.code >= 500:
                raise ProducerUnavailable(url, f"{url} answered {exc.code}: {message}") from None
            raise SpecdraftError(f"producer {url} refused the request ({exc.code}): {message}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, reset, timed out, garbage
            reason = getattr(exc, "reason", exc)
            raise ProducerUnavailable(url, f"{url} is unreachable ({reason})") from None

    def health(self, url: str) -> dict:
        return self._call(url, "/health", None, timeout=min(self.timeout_s, 10.0))

    def describe_target(self) -> dict:
        """The target all reachable producers serve (they must agree)."""
        infos, errors = {}, []
        for url in self.urls:
            try:
                infos[url] = self.health(url)["target"]
            except ProducerUnavailable as exc:
                errors.append(str(exc))
                self._mark_down(url, str(exc))
        if not infos:
            raise SpecdraftError(f"no producer is reachable: {'; '.join(errors)}; start them with `specdraft serve-hidden-states`")
        fingerprints = {info["fingerprint"] for info in infos.values()}
        if len(fingerprints) > 1:
            listing = ", ".join(f"{u}: {i['name']} ({i['fingerprint']})" for u, i in infos.items())
            raise SpecdraftError(f"the producers serve different targets ({listing}); every producer must run the same target")
        info = next(iter(infos.values()))
        self._fingerprint = info["fingerprint"]
        return info

    def refresh(self) -> None:
        """Reread the membership file (at most every ``refresh_s``); admit new producers, retire unlisted ones."""
        if (
            self.membership is None
            or time.monotonic() < self._last_refresh + self.refresh_s
            or not self._refreshing.acquire(blocking=False)
        ):
            return
        try:
            self._last_refresh = time.monotonic()
            try:
                wanted = read_producer_list(self.membership)
                if not wanted:  # more likely a write in progress than every producer retired at once
                    raise SpecdraftError(f"the producer list {self.membership} is empty (replace it atomically: write, then rename)")
            except SpecdraftError as exc:
                log.warning("%s; keeping the producers %s", exc, ", ".join(self.urls))
                return
            with self._lock:
                current = list(self.urls)
            admitted = []
            for url in (u for u in wanted if u not in current):
                try:
                    fingerprint = self.health(url)["target"]["fingerprint"]
                except (ProducerUnavailable, KeyError, TypeError) as exc:
                    log.warning("producer %s listed in %s does not answer its health check (%s); not used yet", url, self.membership, exc)
                    continue
                if self._fingerprint is not None and fingerprint != self._fingerprint:
                    log.error(
                        "producer %s listed in %s serves another target (fingerprint %s, not %s); not used",
                        url,
                        self.membership,
                        fingerprint,
                        self._fingerprint,
                    )
                    continue
                admitted.append(url)
            left = [u for u in current if u not in wanted]
            with self._lock:
                for url in left:
                    self.urls.remove(url)
                    self._down.pop(url, None)
                for url in admitted:
                    self.urls.append(url)
                    self._inflight.setdefault(url, 0)
            for url in admitted:
                log.warning("producer %s joined (listed in %s)", url, self.membership)
            for url in left:
                log.warning("producer %s left (no longer listed in %s); its requests in flight finish", url, self.membership)
        finally:
            self._refreshing.release()

    def unavailable(self) -> dict[str, str]:
        """Producers currently skipped, with the reason each failed."""
        with self._lock:
            return {url: reason for url, (_, reason) in self._down.items()}

    def _mark_down(self, url: str, reason: str) -> None:
        with self._lock:
            self._down[url] = (time.monotonic(), reason)

    def _pick(self, avoid: set[str]) -> str:
        with self._lock:
            now = time.monotonic()
            for url, (since, _) in list(self._down.items()):
                if now - since >= self.down_s:
                    del self._down[url]
            live = [u for u in self.urls if u not in self._down]
            if not live:
                reasons = "; ".join(reason for _, reason in self._down.values())
                raise SpecdraftError(
                    f"every producer failed ({reasons}). If they are down, restart them (`specdraft serve-hidden-states`); if they "
                    "report storage errors (e.g. RPC_FAIL after a Mooncake master restart, which loses every object), fix the "
                    "store, restart the producers, then rerun training to resume from its last checkpoint"
                )
            fresh = [u for u in live if u not in avoid] or live
            tie = next(self._order)
            url = min(fresh, key=lambda u: (self._inflight[u], (self.urls.index(u) - tie) % len(self.urls)))
            self._inflight[url] += 1
            return url

    def extract(self, body: dict, *, avoid: Set[str] = frozenset()) -> tuple[str, dict]:
        """Send one request to a live producer (preferring ones not in ``avoid``); returns (url, reply).

        ``ProducerUnavailable`` marks that producer down; the caller retries with a new key.
        """
        self.refresh()
        url = self._pick(set(avoid))
        try:
            return url, self._call(url, "/extract", body, timeout=self.timeout_s)
        except ProducerUnavailable as exc:
            self._mark_down(url, str(exc))
            raise
        finally:
            with self._lock:
                self._inflight[url] -= 1
