//! balance-svc: keeps memory balanced by migrating sandboxes. Not built yet: see issue 6.
