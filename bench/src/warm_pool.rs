//! A template's warm pool, as the benchmarks that time claims set one: sized in the ledger as
//! an operator does (`sandboxsched-ctl pool`), waited on through the gateway's REST API, and
//! emptied at the end so no pooled sandbox outlives the run.

use std::time::{Duration, Instant};

use anyhow::Context;
use common::pool::{PoolDoc, PoolSlotDoc, POOL_KIND, POOL_SLOT_KIND};
use ledger_client::{LedgerClient, Txn};

/// Sets `template_id`'s pool to `size`.
pub async fn size(ledger: &LedgerClient, template_id: &str, size: u32) -> anyhow::Result<()> {
    let doc = PoolDoc {
        template_id: template_id.to_string(),
        size,
        set_by: common::pool::OPERATOR.into(),
        updated_at_unix_ms: common::clock::now_ms(),
    };
    let txn = match ledger.get::<PoolDoc>(POOL_KIND, template_id).await? {
        Some(current) => Txn::new().update_read(&current, &doc)?,
        None => Txn::new().create(POOL_KIND, template_id, &doc)?,
    };
    ledger.compare(txn).await?;
    Ok(())
}

/// The pool's sandbox IDs once `n` are ready (as the gateway reports them to `key`'s team).
pub async fn ready(
    http: &reqwest::Client,
    url: &str,
    key: &str,
    ledger: &LedgerClient,
    template: &str,
    n: u64,
) -> anyhow::Result<Vec<String>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r: serde_json::Value = http
            .get(format!("{url}/templates/{template}/pool"))
            .header("X-API-Key", key)
            .send()
            .await?
            .json()
            .await?;
        if r["ready"] == n {
            let (slots, _) = ledger.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await?;
            return Ok(slots.into_iter().map(|s| s.value.sandbox_id).collect());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the warm pool of {template} never had {n} ready: {r}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Empties `template_id`'s pool and waits until its slots are gone.
pub async fn empty(ledger: &LedgerClient, template_id: &str) -> anyhow::Result<()> {
    size(ledger, template_id, 0).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ledger.list::<PoolSlotDoc>(POOL_SLOT_KIND, "").await?.0.is_empty() {
        anyhow::ensure!(Instant::now() < deadline, "the warm pool was not emptied within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The ID of the template named `name`.
pub async fn template_id(ledger: &LedgerClient, name: &str) -> anyhow::Result<String> {
    use common::template::{TemplateNameDoc, TEMPLATE_NAME_KIND};
    Ok(ledger
        .get::<TemplateNameDoc>(TEMPLATE_NAME_KIND, name)
        .await?
        .with_context(|| format!("no template is named {name}"))?
        .value
        .template_id)
}
