//! ordnet datapath (userspace side).
