"""Object stores: the protocol and key rules (`protocol`), a local folder (`local`), an S3
bucket (`s3`, with `s3_errors` and `s3_objects`), a primary with a twin site (`twin`), and the
factory that opens the one a URL names (`factory`). Import from the module that holds a name;
this package re-exports nothing, so that no module of it imports another in a circle.
"""
