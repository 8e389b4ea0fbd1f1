//! ordnet API types, CRD generation, manifest loading and validation.
