pub mod op;
