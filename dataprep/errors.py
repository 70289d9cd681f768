"""Errors of data preparation; all are caused by the input and will not pass on a retry."""


class DataprepError(Exception):
    """Base class: the corpus or its settings cannot be turned into a snapshot."""


class SourceError(DataprepError):
    """A source file is missing, unreadable or not text."""


class EmptyCorpusError(DataprepError):
    """Nothing is left to train on after reading and cleaning."""


class BadRecordsError(DataprepError):
    """Too many records of one source file are unreadable: the file is probably not what its
    extension says, or it is damaged."""


class SourceChangedError(SourceError):
    """An object changed or vanished after the snapshot that names its content was planned."""
