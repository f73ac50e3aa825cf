//! A benchmark's result: a titled table for people and a JSON object for scripts.

use std::time::Duration;

use serde_json::{Map, Value};

/// The sample at quantile `p` (0.5 the median) of `samples`, which it sorts; zero for none.
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples.get(i).copied().unwrap_or_default()
}

/// Milliseconds, to two decimals, as the reports show them.
pub fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 100_000.0).round() / 100.0
}

pub struct Report {
    title: String,
    lines: Vec<String>,
    rows: Vec<(String, String)>,
    json: Map<String, Value>,
}

impl Report {
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            lines: Vec::new(),
            rows: Vec::new(),
            json: Map::new(),
        }
    }

    /// Adds a figure to both the table (with `unit`) and the JSON object (under `key`).
    pub fn figure(&mut self, key: &str, value: impl Into<Value>, unit: &str) -> &mut Self {
        let value = value.into();
        let shown = match &value {
            Value::Number(n) if n.is_f64() => format!("{:.3}", n.as_f64().unwrap_or_default()),
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        self.rows
            .push((key.to_string(), format!("{shown} {unit}").trim_end().to_string()));
        self.json.insert(key.to_string(), value);
        self
    }

    /// Adds a line of free text (a table of its own) to the human-readable part.
    pub fn line(&mut self, line: impl Into<String>) -> &mut Self {
        self.lines.push(line.into());
        self
    }

    /// Adds every key of a JSON object to the JSON output.
    pub fn merge(&mut self, value: Value) -> &mut Self {
        if let Value::Object(map) = value {
            self.json.extend(map);
        }
        self
    }

    pub fn print(&self, json: bool) {
        let width = self.rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
        println!("{}", self.title);
        println!("{}", "-".repeat(self.title.len()));
        for line in &self.lines {
            println!("{line}");
        }
        for (key, value) in &self.rows {
            println!("  {key:<width$}  {value}");
        }
        if json {
            println!("{}", Value::Object(self.json.clone()));
        }
    }
}
