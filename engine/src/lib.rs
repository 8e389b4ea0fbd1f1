//! ordnet policy resolution.
