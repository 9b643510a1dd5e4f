"""Patch definitions, one package per capability (patch family); installed as ``megapatch.patches``.

The record ``<family>.<what>`` is declared in ``<family>/<what>.py`` as ``PATCHES = (Patch(...),)``
(see ``megapatch.core.registry``); what a family's records share lives beside them in modules whose
names start with ``_``, and what families share in ``_common.py``. The engine discovers the records;
nothing else imports a patch by name.
"""
