"""Keep credentials out of client libraries' debug logs.

Our own messages never carry secrets (configs hold them as ``SecretStr``; URLs are redacted
before they are shown). Client libraries are another matter: at DEBUG level botocore logs each
canonical request and its headers, session token included. A connector registers its secrets
with :data:`LOG_REDACTOR` while it is open and removes them on close.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence


class LogRedactor(logging.Filter):
    """Replaces registered secrets in the records of the AWS clients' debug loggers.

    botocore logs each canonical request and request headers at DEBUG, and those include the
    session token. Connectors register their secrets while open; records are rewritten only
    when one actually appears, and only if DEBUG is on for those loggers.
    """

    LOGGERS = ("botocore.auth", "botocore.endpoint", "aiobotocore.endpoint")

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._secrets: Counter[str] = Counter()
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)

    def add(self, secrets: Sequence[str]) -> None:
        with self._lock:
            self._secrets.update(secret for secret in secrets if len(secret) >= 4)

    def remove(self, secrets: Sequence[str]) -> None:
        with self._lock:
            self._secrets.subtract(secret for secret in secrets if len(secret) >= 4)
            self._secrets = +self._secrets  # drop the ones no open connector uses any more

    def filter(self, record: logging.LogRecord) -> bool:
        secrets = list(self._secrets)
        if secrets:
            message = record.getMessage()
            redacted = message
            for secret in secrets:
                redacted = redacted.replace(secret, "<redacted>")
            if redacted != message:
                record.msg, record.args = redacted, None
        return True


LOG_REDACTOR = LogRedactor()
