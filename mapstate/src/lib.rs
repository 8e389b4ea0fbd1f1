//! MapState.
