//! Templates: what a new sandbox starts from.
//!
//! A template is a folder `NAME/` in the node's templates directory, with an optional
//! `template.json` (default env vars and start command, see [`Template`]) and an optional
//! `files/` tree copied into every new sandbox's home. The template `base` always exists, even
//! with no templates directory: it seeds nothing.
//!
//! Everything here touches the filesystem and may block: the host calls it from
//! `spawn_blocking`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A template: files that seed a sandbox's home, default env vars, an optional start command.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Template {
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub start_command: Option<String>,
    /// The `files/` folder to copy into a new home, when the template has one.
    #[serde(skip)]
    pub files: Option<PathBuf>,
}

/// Why a template cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("template {0:?} is not on this node")]
    Unknown(String),
    #[error("template {name}: bad template.json: {reason}")]
    Invalid { name: String, reason: String },
}

/// Finds template `name` in `templates_dir`. An empty name means `base`; `base` without a
/// folder of its own is the empty template.
pub fn load(templates_dir: Option<&Path>, name: &str) -> Result<Template, TemplateError> {
    let dir = templates_dir.map(|d| d.join(name));
    if let Some(dir) = dir.filter(|d| d.is_dir()) {
        let mut template: Template = match std::fs::read(dir.join("template.json")) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| TemplateError::Invalid {
                name: name.to_string(),
                reason: e.to_string(),
            })?,
            // No template.json: the template is only its files.
            Err(_) => Template::default(),
        };
        let files = dir.join("files");
        template.files = files.is_dir().then_some(files);
        return Ok(template);
    }
    if name == "base" || name.is_empty() {
        return Ok(Template::default());
    }
    Err(TemplateError::Unknown(name.to_string()))
}

pub use crate::runtime::layout::copy_tree;

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("template-test-{name}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    #[test]
    fn base_exists_without_a_templates_directory() {
        let base = load(None, "base").expect("base");
        assert!(base.env.is_empty() && base.start_command.is_none() && base.files.is_none());
        assert!(load(None, "").is_ok());
        assert!(matches!(load(None, "python"), Err(TemplateError::Unknown(_))));
    }

    #[test]
    fn a_template_folder_gives_env_command_and_files_copied_whole() {
        let dir = scratch("folder");
        let files = dir.join("py/files/sub");
        std::fs::create_dir_all(&files).expect("files");
        std::fs::write(files.join("a.txt"), "a").expect("a.txt");
        std::fs::write(
            dir.join("py/template.json"),
            r#"{"env": {"LANG": "C"}, "start_command": "sleep 1"}"#,
        )
        .expect("template.json");
        let template = load(Some(&dir), "py").expect("py");
        assert_eq!(template.env.get("LANG").map(String::as_str), Some("C"));
        assert_eq!(template.start_command.as_deref(), Some("sleep 1"));
        let home = dir.join("home");
        copy_tree(template.files.as_deref().expect("files"), &home).expect("copy");
        assert_eq!(std::fs::read_to_string(home.join("sub/a.txt")).expect("copied"), "a");

        std::fs::write(dir.join("py/template.json"), "{not json").expect("bad json");
        assert!(matches!(load(Some(&dir), "py"), Err(TemplateError::Invalid { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
