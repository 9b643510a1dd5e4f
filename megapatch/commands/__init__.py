"""What a person runs: the ``megapatch`` CLI (doctor, status, lock, demo) and the ``megapatch-run``
launcher. Nothing here is imported by a training job."""
