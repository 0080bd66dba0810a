//! The CMF container (being written).
