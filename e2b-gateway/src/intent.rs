//! The pure core of the gateway: turning an E2B create request into a complete intent before
//! anything is placed. The template decides resources when it states them, else the request,
//! else the shared defaults; the source of the memory estimate is recorded, so the manifest
//! describes itself (a manifest without a memory estimate is a sandbox the balancer can never
//! move: it would skip it as `UnknownMemoryEstimate`).

use std::collections::BTreeMap;

use common::docs::EstimateSource;
use common::egress::NetworkPolicy;
use common::resources::{DEFAULT_MEMORY_BYTES, DEFAULT_VCPUS};
use common::template::Image;
use serde::Deserialize;

/// Default sandbox timeout, as E2B's SDKs assume (seconds).
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;
/// The most memory one sandbox may ask for (1 TiB): larger asks are refused before any
/// arithmetic on them (2^44 + 256 MB used to wrap to 256 MiB).
pub const MAX_MEMORY_MB: u64 = 1 << 20;
/// The most vCPUs one sandbox may ask for.
pub const MAX_VCPUS: u32 = 256;
/// Longest timeout accepted (24 h).
pub const MAX_TIMEOUT_SECS: u64 = 86_400;
const MAX_ENV_VARS: usize = 256;
const MAX_METADATA: usize = 64;
const MAX_VALUE_BYTES: usize = 4096;

/// A template as a create sees it: its ID, the resources it fixes (if any) and its image.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Template {
    pub name: String,
    #[serde(default)]
    pub vcpus: Option<u32>,
    #[serde(default)]
    pub memory_mb: Option<u64>,
    /// What its sandboxes start from (the registry's; a `--templates` entry has base's).
    #[serde(skip)]
    pub image: Image,
}

/// `NewSandbox`, as E2B's API defines it (the fields this gateway acts on; others are
/// accepted and ignored, `secure` among them: every sandbox's envd is secured by an access
/// token, whatever the request says).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<i64>,
    pub auto_pause: Option<bool>,
    #[serde(rename = "autoPauseMemory")]
    pub auto_pause_memory: Option<bool>,
    #[serde(rename = "autoResume")]
    pub auto_resume: Option<AutoResume>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    /// Not in E2B's schema: resources for templates that do not fix them.
    pub cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    pub memory_mb: Option<u64>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<NetworkConfig>,
}

/// `SandboxAutoResumeConfig`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct AutoResume {
    #[serde(default)]
    pub enabled: bool,
}

/// `SandboxNetworkConfig`: egress rules and who may reach the sandbox's ports.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub egress_proxy: Option<serde_json::Value>,
    pub rules: Option<serde_json::Value>,
    pub mask_request_host: Option<String>,
    pub allow_public_traffic: Option<bool>,
}

/// The sandbox's egress as a [`NetworkPolicy`] (E2B's default: the internet). What this
/// cluster cannot give is refused by name rather than silently run without it: domain names
/// in the lists, IPv6 in `allowOut`, egress proxies, per-domain rules and host masks.
fn network_policy(req: &NewSandbox) -> Result<NetworkPolicy, Refusal> {
    let network = req.network.clone().unwrap_or_default();
    let unsupported = |what: &str| Err(Refusal::Invalid(format!("{what} is not supported on this cluster")));
    if network.egress_proxy.as_ref().is_some_and(|p| !p.is_null()) {
        return unsupported("network.egressProxy");
    }
    if network
        .rules
        .as_ref()
        .is_some_and(|r| r.as_object().is_some_and(|o| !o.is_empty()))
    {
        return unsupported("network.rules (per-domain transforms)");
    }
    if network.mask_request_host.as_ref().is_some_and(|m| !m.is_empty()) {
        return unsupported("network.maskRequestHost");
    }
    NetworkPolicy::from_request(
        req.allow_internet_access,
        network.allow_out.as_deref(),
        network.deny_out.as_deref(),
    )
    .map_err(|e| Refusal::Invalid(e.to_string()))
}

/// `SandboxNetworkUpdateConfig`: the whole new egress policy of a running sandbox (a field
/// left out is cleared, as E2B defines it).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkUpdate {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    pub egress_proxy: Option<serde_json::Value>,
    pub rules: Option<serde_json::Value>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

/// The policy a network update asks for, refusing what this cluster cannot give.
pub fn network_update(update: NetworkUpdate) -> Result<NetworkPolicy, Refusal> {
    let as_create = NewSandbox {
        allow_internet_access: update.allow_internet_access,
        network: Some(NetworkConfig {
            allow_out: update.allow_out,
            deny_out: update.deny_out,
            egress_proxy: update.egress_proxy,
            rules: update.rules,
            ..NetworkConfig::default()
        }),
        ..NewSandbox::default()
    };
    if update.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
        return Err(Refusal::Invalid(
            "network.dnsServers is not supported on this cluster".to_string(),
        ));
    }
    network_policy(&as_create)
}

/// Why a create request is refused before anything happens.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("template '{0}' not found")]
    UnknownTemplate(String),
    #[error("{0}")]
    Invalid(String),
}

/// Everything a create needs, complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CreateIntent {
    pub template: String,
    /// The build its root filesystem comes from.
    pub image: Image,
    pub vcpus: u32,
    pub memory_bytes: u64,
    pub memory_source: EstimateSource,
    pub timeout_secs: u64,
    pub auto_pause: bool,
    /// What an automatic pause keeps (memory and files, or files only).
    pub auto_pause_memory: bool,
    /// Traffic to the paused sandbox resumes it.
    pub auto_resume: bool,
    pub env_vars: BTreeMap<String, String>,
    pub metadata: BTreeMap<String, String>,
    pub network: NetworkPolicy,
    /// `network.allowPublicTraffic` (default true): false makes its ports take a token.
    pub public_traffic: bool,
}

/// Checks a timeout in seconds against E2B's bounds.
pub fn timeout(value: Option<i64>) -> Result<u64, Refusal> {
    match value {
        None => Ok(DEFAULT_TIMEOUT_SECS),
        Some(t) if t <= 0 => Err(Refusal::Invalid(format!("timeout must be positive (got {t})"))),
        Some(t) if t as u64 > MAX_TIMEOUT_SECS => Err(Refusal::Invalid(format!(
            "timeout {t} s exceeds the maximum of {MAX_TIMEOUT_SECS} s"
        ))),
        Some(t) => Ok(t as u64),
    }
}

fn check_map(what: &str, map: &BTreeMap<String, String>, max: usize, env: bool) -> Result<(), Refusal> {
    if map.len() > max {
        return Err(Refusal::Invalid(format!(
            "at most {max} {what} are allowed (got {})",
            map.len()
        )));
    }
    for (k, v) in map {
        let bad_key = k.is_empty()
            || k.len() > 256
            || (env && !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
            || (env && k.starts_with(|c: char| c.is_ascii_digit()));
        if bad_key {
            return Err(Refusal::Invalid(format!("invalid {what} key {k:?}")));
        }
        if k.chars().any(char::is_control) {
            return Err(Refusal::Invalid(format!(
                "{what} key {k:?} contains a control character"
            )));
        }
        if v.len() > MAX_VALUE_BYTES || v.contains('\0') || (!env && v.chars().any(char::is_control)) {
            return Err(Refusal::Invalid(format!(
                "{what} value for {k:?} is too long or contains a control character"
            )));
        }
    }
    Ok(())
}

/// Normalises a create request against its template, as the registry resolved the request's
/// `templateID` (`None`: no such template, or none the caller may use).
pub fn normalise(req: NewSandbox, template: Option<&Template>) -> Result<CreateIntent, Refusal> {
    if req.template_id.trim().is_empty() {
        return Err(Refusal::Invalid("templateID is required".to_string()));
    }
    let template = template.ok_or_else(|| Refusal::UnknownTemplate(req.template_id.clone()))?;
    let timeout_secs = timeout(req.timeout)?;
    let network = network_policy(&req)?;
    let auto_pause_memory = req.auto_pause_memory.unwrap_or(true);
    let auto_resume = req.auto_resume.as_ref().is_some_and(|a| a.enabled);
    if auto_resume && !auto_pause_memory {
        return Err(Refusal::Invalid(
            "autoResume cannot be combined with autoPauseMemory: false (a files-only pause is resumed explicitly)"
                .to_string(),
        ));
    }
    let env_vars = req.env_vars.unwrap_or_default();
    let metadata = req.metadata.unwrap_or_default();
    check_map("envVars", &env_vars, MAX_ENV_VARS, true)?;
    check_map("metadata", &metadata, MAX_METADATA, false)?;
    let (memory_mb, memory_source) = match (template.memory_mb, req.memory_mb) {
        (Some(mb), _) => (mb, EstimateSource::Template),
        (None, Some(mb)) if mb > 0 => (mb, EstimateSource::Request),
        (None, Some(_)) => return Err(Refusal::Invalid("memoryMB must be positive".to_string())),
        (None, None) => (DEFAULT_MEMORY_BYTES >> 20, EstimateSource::Default),
    };
    if memory_mb > MAX_MEMORY_MB {
        return Err(Refusal::Invalid(format!(
            "memoryMB {memory_mb} exceeds the maximum of {MAX_MEMORY_MB}"
        )));
    }
    let memory_bytes = memory_mb << 20;
    let vcpus = match (template.vcpus, req.cpu_count) {
        (Some(v), _) => v,
        (None, Some(v)) if v > 0 => v,
        (None, Some(_)) => return Err(Refusal::Invalid("cpuCount must be positive".to_string())),
        (None, None) => DEFAULT_VCPUS,
    };
    if vcpus > MAX_VCPUS {
        return Err(Refusal::Invalid(format!(
            "cpuCount {vcpus} exceeds the maximum of {MAX_VCPUS}"
        )));
    }
    Ok(CreateIntent {
        template: template.name.clone(),
        image: template.image.clone(),
        vcpus,
        memory_bytes,
        memory_source,
        timeout_secs,
        auto_pause: req.auto_pause.unwrap_or(false),
        auto_pause_memory,
        auto_resume,
        env_vars,
        metadata,
        network,
        public_traffic: req
            .network
            .as_ref()
            .and_then(|n| n.allow_public_traffic)
            .unwrap_or(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn templates() -> BTreeMap<String, Template> {
        [("base", None, None), ("big", Some(4), Some(4096))]
            .into_iter()
            .map(|(name, vcpus, memory_mb)| {
                let t = Template {
                    name: name.into(),
                    vcpus,
                    memory_mb,
                    image: Image::base(),
                };
                (name.to_string(), t)
            })
            .collect()
    }

    /// Normalises against the test templates, looked up by name as the registry would.
    fn norm(r: NewSandbox) -> Result<CreateIntent, Refusal> {
        let name = r.template_id.split(':').next().unwrap_or("").to_string();
        normalise(r, templates().get(&name))
    }

    fn req(template: &str) -> NewSandbox {
        NewSandbox {
            template_id: template.into(),
            ..NewSandbox::default()
        }
    }

    #[test]
    fn egress_is_a_policy_and_what_cannot_be_given_is_refused() {
        let d = norm(req("base")).unwrap();
        assert_eq!(d.network, NetworkPolicy::default(), "unset: the internet, as on E2B");
        let mut closed = req("base");
        closed.allow_internet_access = Some(false);
        closed.network = Some(NetworkConfig {
            allow_out: Some(vec!["1.1.1.1".into()]),
            deny_out: Some(vec!["10.0.0.0/8".into()]),
            allow_public_traffic: Some(true),
            ..NetworkConfig::default()
        });
        let closed = norm(closed).unwrap().network;
        assert!(!closed.internet && closed.allow_out.len() == 1 && closed.deny_out.len() == 1);
        let refused = |r: NewSandbox| match norm(r) {
            Err(Refusal::Invalid(message)) => message,
            other => panic!("{other:?}"),
        };
        let mut domain = req("base");
        domain.network = Some(NetworkConfig {
            allow_out: Some(vec!["example.com".into()]),
            ..NetworkConfig::default()
        });
        let message = refused(domain);
        assert!(
            message.contains("network.allowOut") && message.contains("domain"),
            "{message}"
        );
        let mut rules = req("base");
        rules.network = Some(NetworkConfig {
            rules: Some(serde_json::json!({"api.example.com": [{"transform": {"headers": {"x": "y"}}}]})),
            ..NetworkConfig::default()
        });
        assert!(refused(rules).contains("per-domain"));
    }

    #[test]
    fn every_intent_has_a_memory_estimate_and_its_source() {
        let d = norm(req("base")).unwrap();
        assert_eq!(
            (d.memory_bytes, d.memory_source, d.vcpus),
            (DEFAULT_MEMORY_BYTES, EstimateSource::Default, 1)
        );
        let t = norm(req("big")).unwrap();
        assert_eq!(
            (t.memory_bytes, t.memory_source, t.vcpus),
            (4096 << 20, EstimateSource::Template, 4)
        );
        let mut r = req("base");
        r.memory_mb = Some(1024);
        let r = norm(r).unwrap();
        assert_eq!((r.memory_bytes, r.memory_source), (1024 << 20, EstimateSource::Request));
        // The template wins over the request where it states resources.
        let mut over = req("big");
        over.memory_mb = Some(64);
        assert_eq!(norm(over).unwrap().memory_source, EstimateSource::Template);
    }

    #[test]
    fn refusals() {
        assert_eq!(norm(req("nope")), Err(Refusal::UnknownTemplate("nope".into())));
        assert!(norm(req("")).is_err());
        for t in [0, -5, 86_401] {
            let mut r = req("base");
            r.timeout = Some(t);
            assert!(norm(r).is_err(), "timeout {t}");
        }
        let mut r = req("base");
        r.env_vars = Some([("BAD-KEY".to_string(), "x".to_string())].into());
        assert!(norm(r).is_err());
        let mut r = req("base:latest");
        r.timeout = Some(60);
        assert_eq!(norm(r).unwrap().timeout_secs, 60);
    }
}
