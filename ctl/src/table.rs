//! Aligned text tables for people; the same rows become JSON for scripts.

use serde_json::{Map, Value};

/// Rows of named columns.
pub struct Table {
    columns: Vec<&'static str>,
    rows: Vec<Vec<Value>>,
}

impl Table {
    pub fn new(columns: &[&'static str]) -> Self {
        Self {
            columns: columns.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<Value>) {
        self.rows.push(cells);
    }

    /// One JSON object per row, keyed by column.
    pub fn json(&self) -> Value {
        Value::Array(
            self.rows
                .iter()
                .map(|row| {
                    let object: Map<String, Value> = self
                        .columns
                        .iter()
                        .zip(row)
                        .map(|(c, v)| (c.to_string(), v.clone()))
                        .collect();
                    Value::Object(object)
                })
                .collect(),
        )
    }

    pub fn print(&self, json: bool) {
        if json {
            println!("{}", self.json());
            return;
        }
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            Value::Null => "-".to_string(),
            Value::Number(n) if n.is_f64() => format!("{:.3}", n.as_f64().unwrap_or_default()),
            other => other.to_string(),
        };
        let cells: Vec<Vec<String>> = self.rows.iter().map(|r| r.iter().map(text).collect()).collect();
        let widths: Vec<usize> = (0..self.columns.len())
            .map(|i| {
                cells
                    .iter()
                    .map(|r| r.get(i).map_or(0, String::len))
                    .chain([self.columns[i].len()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |values: Vec<&str>| {
            values
                .iter()
                .zip(&widths)
                .map(|(v, w)| format!("{v:<w$}"))
                .collect::<Vec<_>>()
                .join("  ")
                .trim_end()
                .to_string()
        };
        println!(
            "{}",
            line(
                self.columns
                    .iter()
                    .map(|c| c.to_uppercase())
                    .collect::<Vec<_>>()
                    .iter()
                    .map(String::as_str)
                    .collect()
            )
        );
        for row in &cells {
            println!("{}", line(row.iter().map(String::as_str).collect()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rows_become_objects_keyed_by_column() {
        let mut t = Table::new(&["node", "free"]);
        t.row(vec![json!("n1"), json!(3)]);
        assert_eq!(t.json(), json!([{"node": "n1", "free": 3}]));
    }
}
