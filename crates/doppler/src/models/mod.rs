//! Model definitions built from the ops and recorded on the autograd tape.

pub mod transformer;
