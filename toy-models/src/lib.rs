//! placeholder for dependency build
