"""Patch definitions, one module per patch set; installed as ``megapatch.patches``.

Each module declares ``PATCHES = (Patch(...), ...)`` (see ``megapatch.core.registry``). The engine
discovers them; nothing else imports a patch by name.
"""
